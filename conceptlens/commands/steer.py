"""`conceptlens steer`: a prompt's continuation without and with a steering edit, side by side.

    conceptlens steer --concepts runs/demo/concepts --concept 12 --alpha 0.5 --prompt "I went to the shop and"
    conceptlens steer --direction-word " wedding" --site blocks.15.resid_out --alpha 0.5 --prompt "..."

The direction is a concept of a saved ConceptSet (several indices are summed; sets that
carry the fit's mean activation are centred first, unless `--no-centre`) or the unembedding
row of a word of one token. `--scale` is `Add`'s: by default `robust_norm`, so alpha is a
multiple of the site's typical token norm without its massive coordinates
(`conceptlens.steering.units`) and means the same on every model (0.25-1 is typical;
`conceptlens sweep` finds where fluency breaks); `site_norm` counts the massive coordinates,
`unit` makes alpha a distance, `raw` uses the direction as stored.
"""

from __future__ import annotations

import argparse
import math
import shutil
import textwrap
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from conceptlens.commands._args import concept_dir, finite_float, nonempty_text, positive_int
from conceptlens.commands._common import check_one_site
from conceptlens.devices import input_device

if TYPE_CHECKING:
    from conceptlens.concepts.conceptset import ConceptSet

POSITIONS = ("all", "prompt", "generated")
SCALES = ("robust_norm", "site_norm", "unit", "raw")


def add_direction_arguments(parser: argparse.ArgumentParser) -> None:
    """What to steer along and where (shared by `steer` and `sweep`): --model, --concepts DIR or
    --direction-word WORD, --concept, --site."""
    parser.add_argument("--model", help="registered name, hub id or local folder (default: the model the concept set "
                                        "was fitted on, as its run's run.toml names it; smollm2-135m with "
                                        "--direction-word)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--concepts", metavar="DIR", type=concept_dir, help="a saved ConceptSet folder")
    source.add_argument("--direction-word", metavar="WORD", type=nonempty_text,
                        help="steer along the unembedding of this word")
    parser.add_argument("--concept", type=int, nargs="+", metavar="I",
                        help="concept index in DIR (several are summed); needed when DIR holds more than one")
    parser.add_argument("--site", help="where to steer (default: the concept set's site; with --direction-word "
                                       "the middle block's resid_out)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_direction_arguments(parser)
    parser.add_argument("--alpha", type=finite_float, default=0.5,
                        help="steering strength in --scale units (default 0.5: half a typical token norm)")
    parser.add_argument("--scale", choices=SCALES, default="robust_norm",
                        help="unit of alpha: robust_norm (default; multiples of the site's median token norm "
                             "without its massive coordinates), site_norm (with them), unit (a distance), "
                             "raw (the direction as stored)")
    parser.add_argument("--no-centre", action="store_true",
                        help="steer with the stored concept directions even when the set carries the fit's mean")
    parser.add_argument("--prompt", required=True, type=nonempty_text)
    parser.add_argument("--positions", choices=POSITIONS, default="generated",
                        help="which tokens the edit touches (default: generated)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")


def run(args: argparse.Namespace) -> int:
    import conceptlens
    from conceptlens.commands._common import check_generation_length, check_predicts_tokens, load_model
    from conceptlens.steering import Add

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    concepts = choose_model(args)
    model, tokenizer = load_model(args)
    check_predicts_tokens(model, "steer continues a prompt, so it", "steer a decoder (smollm2-135m, a Gemma) or an "
                          "encoder-decoder, or measure an encoder's concepts with `ablate --task probe`")
    check_generation_length(model, tokenizer, args.max_new_tokens)
    lens = conceptlens.attach(model, tokenizer)
    direction, site, what = steering_direction(lens, args, concepts)
    edit = Add(direction, args.alpha, scale=args.scale, site=site)
    prompt = chat_prompt(tokenizer, args.prompt) if args.chat else args.prompt
    bare, steered = continuations(lens, edit, prompt, positions=args.positions, max_new_tokens=args.max_new_tokens)
    print(f"prompt: {args.prompt!r}\nsteering: {what}, alpha {args.alpha:g} at {site} ({strength(edit)}), "
          f"positions={args.positions}\n")
    print(side_by_side("unsteered", bare, "steered", steered))
    return 0


def choose_model(args: argparse.Namespace) -> ConceptSet | None:
    """Set args.model when not given: the model of the run the concept set belongs to (its run.toml,
    which names a local model by its whole path), else the one the set names; smollm2-135m for
    --direction-word. Checks --concept against the set's size first, all before the model loads.
    Returns the --concepts set, loaded (None for --direction-word), for `steering_direction`."""
    from conceptlens import ConceptSet

    concepts = None if args.concepts is None else ConceptSet.load(args.concepts)
    if concepts is not None:
        n = len(concepts)
        bad = [i for i in args.concept or [] if not -n <= i < n]
        if bad:
            raise ValueError(f"--concept {bad[0]} is out of range: {args.concepts} holds {n} concepts, "
                             f"valid indices are 0-{n - 1} (or -{n} to -1)")
    if args.model:
        return concepts
    if concepts is None:
        args.model = "smollm2-135m"
        return None
    from conceptlens.commands.run_folder import model_of

    args.model = model_of(args.concepts, concepts)
    return concepts


def strength(edit: Any) -> str:
    """What alpha meant for a bound `Add`, in words: "x robust norm 115 = |v| 57.5"."""
    size = float(edit.vector.norm())
    if edit.scale in ("robust_norm", "site_norm"):
        return f"x {edit.scale.replace('_', ' ')} {edit.norm:.4g}: |v| = {size:.4g}"
    return f"{'unit direction' if edit.scale == 'unit' else 'raw direction'}: |v| = {size:.4g}"


def steering_direction(lens: Any, args: argparse.Namespace,
                       concepts: ConceptSet | None = None) -> tuple[ConceptSet, str, str]:
    """(the direction as a one-concept set, site name, description) from --concepts/--concept or
    --direction-word; `concepts`: the --concepts set when already loaded (`choose_model`). A set keeps
    the model its concepts were fitted on, so `Add` warns when it is used on another model, as it
    does in the library."""
    from conceptlens import ConceptSet

    if args.direction_word is not None:
        if args.concept:
            raise ValueError("--concept selects from --concepts; it does not apply to --direction-word")
        direction, site, what = word_direction(lens, args.direction_word, args.site)
        return ConceptSet(direction, site, method="unembedding", model=lens.name), site, what
    concepts = concepts if concepts is not None else ConceptSet.load(args.concepts)
    n = len(concepts)
    indices = args.concept if args.concept else ([0] if n == 1 else None)
    if indices is None:
        raise ValueError(f"{args.concepts} holds {n} concepts: choose with --concept I (0-{n - 1})")
    if concepts.config.get("widths"):  # a crosscoder's: a block of each direction at each of its sites
        concepts = _at_one_site(lens, concepts, args.site, args.concepts)
    check_one_site(concepts.site, args.concepts, concepts.method, "steer")  # e.g. a CLVQ code space
    site = _concept_site(lens, concepts.site, args.site, args.concepts)
    centre = concepts.mean is not None and not getattr(args, "no_centre", False)
    direction = (concepts.centred() if centre else concepts).directions[indices].sum(0)
    _check_width(lens, site, direction)
    what = f"concept{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}{' (centred)' if centre else ''}"
    return ConceptSet(direction, site, method=concepts.method, model=concepts.model), site, what


def word_direction(lens: Any, word: str, site: str | None) -> tuple[Tensor, str, str]:
    """The unembedding row of `word`, one token, at `site` (default: the middle block's resid_out)."""
    ids = lens.tokenizer(word, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"--direction-word {word!r} encodes to no tokens")
    if len(ids) > 1:  # its first token's row alone would steer towards a word piece
        spellings = [(f" {word.strip()}", "with a leading space"), (word.strip(), "without spaces")]
        one = next(((w, how) for w, how in spellings if w != word
                    and len(lens.tokenizer(w, add_special_tokens=False)["input_ids"]) == 1), None)
        hint = f"; {one[0]!r}, {one[1]}, is one" if one else "; give a word of one token"
        pieces = ", ".join(repr(lens.tokenizer.decode([i])) for i in ids)
        raise ValueError(f"--direction-word {word!r} is {len(ids)} tokens here ({pieces}){hint}")
    head = lens.model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(lens.model).__name__} has no output embeddings; use --concepts")
    if site is None:
        if "" not in lens.adapter.n_blocks:
            raise ValueError("pass --site: there is no default site for an encoder-decoder model")
        site = f"blocks.{lens.adapter.n_blocks[''] // 2}.resid_out"
    site = lens.site(site).name
    direction = head.weight[ids[0]].detach().float()
    _check_width(lens, site, direction)
    return direction, site, f"unembedding of {lens.tokenizer.decode(ids[:1])!r}"


def _concept_site(lens: Any, stored: str | None, given: str | None, folder: str) -> str:
    if stored is None and given is None:
        raise ValueError(f"the concept set in {folder} records no site; pass --site")
    if stored is not None and given is not None and lens.site(given).name != lens.site(stored).name:
        raise ValueError(f"the concepts in {folder} live at {stored!r}; --site {given!r} is a different space")
    return lens.site(given or stored).name


def _at_one_site(lens: Any, concepts: ConceptSet, given: str | None, folder: str) -> ConceptSet:
    """The directions' block at `given` of a set that spans several sites (`split_concept_set`)."""
    from conceptlens.concepts.sae.crosscoder import split_concept_set

    blocks = split_concept_set(concepts)
    if given is None:
        raise ValueError(f"the concepts in {folder} span {len(blocks)} sites ({', '.join(blocks)}): "
                         "steer at one of them with --site")
    if (name := lens.site(given).name) not in blocks:
        raise ValueError(f"--site {given!r} is not a site of the concepts in {folder}; they span {', '.join(blocks)}")
    return blocks[name]


def _check_width(lens: Any, site: str, direction: Tensor) -> None:
    at = lens.site(site)
    if at.point == "pattern" or not all(isinstance(s, int) for s in at.shape[2:]):
        raise ValueError(f"{at.name} is read only (attention probabilities, width growing with the sequence); "
                         "steer attn.q or attn.k, or a residual site such as blocks.N.resid_out")
    width = math.prod(int(s) for s in at.shape[2:])
    if direction.shape[-1] != width:
        raise ValueError(f"the direction has width {direction.shape[-1]} but {site} has width {width}")


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: this tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


@torch.no_grad()
def continuations(lens: Any, edit: Any, prompt: str, *, positions: str = "generated",
                  max_new_tokens: int = 32) -> tuple[str, str]:
    """Greedy continuations of `prompt` without and with `edit`: (unsteered, steered)."""
    tokenizer, model = lens.tokenizer, lens.model
    device = input_device(model)
    inputs = {k: v.to(device) for k, v in tokenizer([prompt], return_tensors="pt").items()}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = inputs["input_ids"].shape[1]

    def generate() -> str:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        return tokenizer.decode(out[0, start:], skip_special_tokens=True)

    bare = generate()
    with lens.steer(edit, positions=positions):
        return bare, generate()


def side_by_side(left_title: str, left: str, right_title: str, right: str, width: int | None = None) -> str:
    """Two titled, wrapped text columns (stacked when the terminal is narrower than 60)."""
    width = width or shutil.get_terminal_size((100, 24)).columns
    if width < 60:
        return f"{left_title}:\n{textwrap.fill(left, width)}\n\n{right_title}:\n{textwrap.fill(right, width)}"
    column = (width - 3) // 2
    wrap = lambda text: textwrap.wrap(text, column, replace_whitespace=True) or [""]  # noqa: E731
    lefts, rights = [left_title, "-" * column, *wrap(left)], [right_title, "-" * column, *wrap(right)]
    rows = max(len(lefts), len(rights))
    lefts, rights = lefts + [""] * (rows - len(lefts)), rights + [""] * (rows - len(rights))
    return "\n".join(f"{a:<{column}} | {b}".rstrip() for a, b in zip(lefts, rights))
