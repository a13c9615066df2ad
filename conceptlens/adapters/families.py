"""The few architectures the structural adapter cannot handle alone.

Everything else is recognised by `structure.py`. An entry here is a real exception:
`LAYOUT` overrides block-relative paths of a recognised layout (ALBERT: its attention adds and
norms its own residual, so `attn_out` is `attention.dense`; its FFN is two bare Linear children,
so `mlp_out` is `ffn_output`), `NOTES` adds to site descriptions (DeBERTa's attention does not
call the attention-function interface: its q/k/v sites are its content projections), `REFUSED`
names architectures whose blocks are not one layer each and says why (Funnel: it pools the
sequence between blocks, each layer reads the residual as query, key and value separately, and
its hidden states have three lengths plus its decoder's). Bloom needs no entry: its sublayers are
read at their output projections by `repair.py`'s rule.
"""

from __future__ import annotations

LAYOUT: dict[str, dict[str, str]] = {
    # ALBERT's attention adds and norms its own residual, and its FFN is two bare Linear children.
    "albert": {"attn_out": "attention.dense", "attn_z": "attention.dense", "mlp_out": "ffn_output",
               "mlp_post": "ffn_output"},
}

NOTES: dict[str, dict[str, str]] = {
    "deberta-v2": {"q": "content query from query_proj (DeBERTa's attention does not go through the "
                        "attention-function interface; its relative-position terms are separate)",
                   "k": "content key from key_proj (see q)", "v": "from value_proj"},
}
NOTES["deberta"] = NOTES["deberta_v2"] = NOTES["deberta-v2"]

REFUSED: dict[str, str] = {
    "funnel": "Funnel Transformer pools the sequence between its encoder's groups of layers (to about T/2 and T/4 "
              "rows, which are not tokens) and upsamples it in its decoder, so its hidden states are not one stack "
              "of same-length block outputs",
}
