"""ConceptSets (and SAELens-format SAEs) on the Hugging Face Hub, through huggingface_hub.

    cs = ConceptSet.from_pretrained("user/smollm2-concepts", subfolder="blocks.15.resid_out")
    cs = ConceptSet.from_pretrained("runs/demo/concepts/topk")       # a local folder works too
    cs.push_to_hub("user/smollm2-concepts", subfolder="blocks.15.resid_out")

A repo folder holds either our layout (`config.json` + `concepts.safetensors`) or SAELens's
(`cfg.json` + `sae_weights.safetensors`, read with `import_saelens`). Downloads go through
`snapshot_download` restricted to the subfolder, so `HF_HUB_OFFLINE=1` with a filled cache
(or `local_files_only=True`) works without a network; pushing writes a model card
(README.md) naming the model, site, method, data and the fit's figures.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conceptlens._names import check_subfolder
from conceptlens.concepts.conceptset import CONFIG_FILE, TENSOR_FILE

if TYPE_CHECKING:
    from conceptlens.concepts.conceptset import ConceptSet

SAELENS_FILES = ("cfg.json", "sae_weights.safetensors")


def from_pretrained(repo_or_path: str | os.PathLike, *, subfolder: str | None = None,
                    revision: str | None = None, local_files_only: bool = False,
                    cache_dir: str | os.PathLike | None = None, token: str | bool | None = None) -> ConceptSet:
    """Load a ConceptSet from a local folder or a Hub repo (our layout or SAELens's)."""
    subfolder = check_subfolder(subfolder)
    local = Path(repo_or_path)
    if local.is_dir():
        folder = local / subfolder if subfolder else local
    else:
        folder = _download(str(repo_or_path), subfolder, revision, local_files_only, cache_dir, token)
    return _read(folder)


def _download(repo_id: str, subfolder: str | None, revision: str | None, local_files_only: bool,
              cache_dir: str | os.PathLike | None, token: str | bool | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    patterns = [f"{subfolder.strip('/')}/*"] if subfolder else None
    try:
        root = snapshot_download(repo_id, revision=revision, allow_patterns=patterns,
                                 cache_dir=None if cache_dir is None else Path(cache_dir),
                                 local_files_only=local_files_only, token=token)
    except HFValidationError:
        raise FileNotFoundError(f"{repo_id!r} is neither a local folder nor a Hub repo id ('user/name')") from None
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{repo_id!r} is not a local folder and is not in the Hub cache; downloading it "
                                "needs network access (HF_HUB_OFFLINE is set or the Hub is unreachable)") from None
    return Path(root) / subfolder if subfolder else Path(root)


def _read(folder: Path) -> ConceptSet:
    from conceptlens.concepts.conceptset import ConceptSet
    from conceptlens.concepts.sae.saelens import import_saelens

    if (folder / CONFIG_FILE).is_file() and (folder / TENSOR_FILE).is_file():
        return ConceptSet.load(folder)
    if all((folder / name).is_file() for name in SAELENS_FILES):
        return import_saelens(folder)
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else None
    raise FileNotFoundError(f"{folder} holds no ConceptSet ({CONFIG_FILE} + {TENSOR_FILE}) and no SAELens SAE "
                            f"({' + '.join(SAELENS_FILES)}); found {found}")


def push_to_hub(cs: ConceptSet, repo_id: str, *, subfolder: str | None = None, private: bool | None = None,
                token: str | bool | None = None, commit_message: str | None = None,
                data: str | None = None) -> Any:
    """Upload `cs` (and a model card) to `repo_id`, into `subfolder` when given."""
    from huggingface_hub import HfApi

    subfolder = check_subfolder(subfolder)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cs.save(folder / (subfolder or "."))
        (folder / "README.md").write_text(model_card(cs, data=data))
        return api.upload_folder(repo_id=repo_id, folder_path=folder,
                                 commit_message=commit_message or f"Upload {cs.method} concepts at {cs.site}")


def model_card(cs: ConceptSet, *, data: str | None = None) -> str:
    """A short README.md: what the concepts are, where they live, how they were fitted."""
    fit = cs.config.get("fit") or {}
    data = data or fit.get("data")
    figures = {k: v for k, v in (cs.config.get("figures") or fit.get("figures") or {}).items()}
    front = {"library_name": "conceptlens", "tags": ["conceptlens", "interpretability", cs.method]}
    if cs.model and "/" in cs.model and not Path(cs.model).is_absolute():
        front["base_model"] = cs.model
    lines = ["---", *(f"{k}: {json.dumps(v)}" for k, v in front.items()), "---", "",
             f"# {cs.method} concepts of {cs.model or 'a model'} at `{cs.site}`", "",
             f"- **model**: {cs.model or 'unknown'}", f"- **site**: `{cs.site}`",
             f"- **method**: {cs.method} ({len(cs)} concepts of width {cs.d})",
             f"- **data**: {data or 'not recorded'}"]
    if fit.get("tokens"):
        lines.append(f"- **tokens seen**: {fit['tokens']:,}")
    lines += [f"- **{k}**: {v}" for k, v in figures.items()]
    hp = {k: v for k, v in cs.config.items() if k not in ("fit", "figures") and isinstance(v, (int, float, str))}
    if hp:
        lines += ["", "Hyper-parameters: " + ", ".join(f"{k}={v}" for k, v in sorted(hp.items()))]
    lines += ["", "```python", "from conceptlens import ConceptSet",
              f"cs = ConceptSet.from_pretrained(\"<this repo>\")", "```", ""]
    return "\n".join(lines)
