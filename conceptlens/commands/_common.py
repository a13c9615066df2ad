"""Options every command shares (threads, device, dtype, logging) and the one way commands load a model.

    model, tok = load_model(args)          # args.model, with --device / --dtype applied
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from conceptlens.commands._args import threads

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("runtime")
    group.add_argument("--threads", type=threads, default=None,
                       help="torch CPU threads (default: torch's choice; 1 is often fastest on a busy machine)")
    group.add_argument("--device", default=None,
                       help="where the model runs: cpu, cuda, cuda:1, mps, or 'auto' (accelerate device map)")
    group.add_argument("--dtype", default=None, choices=DTYPES, help="model weights dtype (default: the loader's)")
    group.add_argument("--log-level", default="warning", choices=LOG_LEVELS, help="messages of the conceptlens logger")


def apply_runtime(args: argparse.Namespace) -> None:
    """Check and apply the shared options before any work: threads, logging, device and model names."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    level = getattr(logging, (getattr(args, "log_level", None) or "warning").upper())
    logger = logging.getLogger("conceptlens")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("conceptlens: %(message)s"))
        logger.addHandler(handler)
    device = getattr(args, "device", None)
    if device and device != "auto":
        check_device(device)
    model = getattr(args, "model", None)
    if isinstance(model, str):
        from conceptlens.models import check_name

        check_name(model)


def check_device(device: str) -> None:
    """A device the model can run on here: cpu, cuda[:N] with CUDA, mps with Metal (or auto); else a
    one-line ValueError listing the valid choices (meta holds no weights: nothing can run on it)."""
    from conceptlens._checks import check_device as usable, usable_devices

    try:
        usable("--device", device)
    except ValueError:
        raise ValueError(f"--device {device!r} is not available here; valid: "
                         f"{', '.join(['cpu', 'auto', *usable_devices()[1:]])}") from None


def load_model(args: argparse.Namespace, name: str | None = None, dtype: str | None = None) -> tuple[Any, Any]:
    """`models.load(name or args.model)` with the command's --device and --dtype (else `dtype`: a run's)."""
    import torch

    from conceptlens import models

    kwargs: dict[str, Any] = {}
    dtype = getattr(args, "dtype", None) or dtype
    if dtype and dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    device = getattr(args, "device", None)
    if device == "auto":
        kwargs["device_map"] = "auto"
    model, tokenizer = models.load(name or args.model, **kwargs)
    if device and device != "auto":
        model = model.to(device)
    return model, tokenizer



def check_generation_length(model: Any, tokenizer: Any, max_new_tokens: int, option: str = "--max-new-tokens") -> None:
    """Refuse a generation longer than the model's context (config.max_position_embeddings or
    n_positions, else the tokenizer's model_max_length), naming the option and the limit."""
    config = getattr(model, "config", None)
    limit = next((v for k in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
                  if isinstance(v := getattr(config, k, None), int) and v > 0), None)
    source = "the model's context"
    if limit is None:
        limit = getattr(tokenizer, "model_max_length", None)
        limit = limit if isinstance(limit, int) and 0 < limit < 10**9 else None
        source = "the tokenizer's model_max_length"
    if limit is not None and max_new_tokens > limit:
        raise ValueError(f"{option} {max_new_tokens} exceeds {source} of {limit} tokens; use at most {limit}")


def check_predicts_tokens(model: Any, what: str, instead: str) -> None:
    """A one-line ValueError unless `model` has a language-model head that `generate()` can drive (a
    decoder's or encoder-decoder's): `what` needs its next-token predictions; `instead` says what to do."""
    can = getattr(model, "can_generate", None)
    if not (callable(can) and can()):
        raise ValueError(f"{what} needs a model that predicts tokens, and {type(model).__name__} has no language-model "
                         f"head (an encoder); {instead}")


def check_one_site(site: str | None, folder: Any, method: str | None, command: str) -> None:
    """A one-line error for a set whose directions span several sites or live at no model site (a
    crosscoder's "A+B", a CLVQ code space's "A->B:z_e") given to a command that takes a set of one site."""
    if site is not None and ("+" in site or "->" in site):
        raise ValueError(f"the {method or 'concept'} set in {folder} lives at {site!r}, not at one site of the model: "
                         f"{command} takes a set of one site (fit one with --site, e.g. topk or kmeans)")
