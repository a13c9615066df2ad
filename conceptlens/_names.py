"""The one rule for names that become folder or file names: extractors, concept sets, sites
in a run folder, Hub subfolders. Checked where a name is given and where a folder is read.

    check_name("blocks.15.resid_out__topk", "extractor name")    # returns the name
    check_name("..", "extractor name")      # ValueError: ... is not a safe folder name; ...
    check_subfolder("layer_20/width_16k")   # each '/'-separated part is a name
"""

from __future__ import annotations

import re

MAX_LENGTH = 200  # under the 255 bytes a folder name may have, with room for '.html' and temporary suffixes
# letters, digits, '.', '_', '-'; no leading '.', so never '.', '..' or a hidden file
NAME = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{MAX_LENGTH - 1}}}")
RULE = f"use letters, digits, '.', '_' and '-', not starting with '.' (at most {MAX_LENGTH} characters)"


def is_name(name: object) -> bool:
    return isinstance(name, str) and NAME.fullmatch(name) is not None


def check_name(name: object, what: str = "name") -> str:
    """`name` when it is a safe folder name, else a ValueError naming it and the rule."""
    if not is_name(name):
        raise ValueError(f"{what} {name!r} is not a safe folder name; {RULE}")
    return name  # type: ignore[return-value]


def check_subfolder(subfolder: str | None) -> str | None:
    """A relative path inside a repo or folder: '/'-separated names (no '..', no absolute path)."""
    if subfolder is None or subfolder == "":
        return None
    if not isinstance(subfolder, str) or not all(is_name(part) for part in subfolder.split("/")):
        raise ValueError(f"subfolder {subfolder!r} is not a path inside the repo; give '/'-separated names "
                         f"(e.g. 'layer_20/width_16k'): in each, {RULE}")
    return subfolder
