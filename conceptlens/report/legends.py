"""What every figure and number of the atlas means: each figure is a `<figure>` with its legend.

    figure(table_html, LEGENDS["probe"])    # <figure>...<figcaption class="legend">...</figcaption></figure>

The texts live here, once, so the index and the concept pages say the same thing.
"""

from __future__ import annotations

DUPLICATE_COSINE = 0.99
"""Two concepts whose directions have a cosine above this are flagged as near-duplicates."""

HEADS_SHARE = 0.25
"""Warn when one token is the first top token of more than this share of a set's concepts."""

LEGENDS = {
    "activation": "Activation: an SAE's latent (its encoder's output; active when > 0). For dense sets (k-means, "
                  "Deleuzian, VQ, random controls) the cosine between the token and the concept's direction, both "
                  "measured from the fit's mean activation (centroids become c - mean): bounded in [-1, 1], so a token "
                  "with a huge norm does not top every concept. A dense concept is active on a token when its cosine "
                  "is > 0.",
    "frequency": "Frequency: share of described tokens on which the concept is active (activation > 0), the mass "
                 "right of 0 in its histogram.",
    "assigned": "Assigned: share of tokens whose nearest centre (k-means, VQ) or largest cosine (other dense sets) "
                "is this concept.",
    "histogram": "Histogram of the concept's activation over every described token; bars drawn with their real bin "
                 "widths on a linear axis, height = tokens per unit of activation (a density; hover a bar for its "
                 "range and count). Exact zeros (inactive SAE latents) are not drawn.",
    "histogram zero": "The dashed line marks 0.",
    "contexts": "Top contexts: the tokens with the largest activation and the text around them. The number is the "
                "activation of the outlined token; each token is shaded by its own activation for this concept "
                "(orange positive, blue negative, darker is larger, relative to the largest shown); hover for the value.",
    "probe": "A 1-D logistic probe per class on the concept's document-mean activation (even documents train, odd "
             "test). Probe log-loss: its test loss (nats; lower is better). Base-rate entropy: the loss of always "
             "predicting the class rate. Gain (nats) = base-rate entropy - probe loss; a green loss beats the base rate.",
    "tokens": "Promoted / suppressed tokens: the unit direction read through the model's unembedding (no final "
              "norm): the tokens whose logits it raises or lowers most; hover for the logit change per unit norm.",
    "neighbours": "Nearest by direction: largest cosine between unit directions (centred as the activations are); "
                  "a cosine above 0.99 is a near-duplicate. Nearest by co-activation: Jaccard of firing (SAEs) or "
                  "Pearson correlation of activations (dense sets) on a strided sample of tokens; scores of 0 or below are "
                  "not listed.",
    "steering": "The prompt continued greedily with alpha times the site's typical token norm added along the unit "
                "direction{where}; alpha 0 is the unsteered text.",
    "map": "Each point is a concept: PCA of its unit direction (centred as the activations are), so nearby points "
           "point alike; axes have no units. Size: frequency. Colour: the class its best probe predicts (grey: no "
           "labels, or no class whose probe beats its base rate). Click a point to open the concept.",
    "concepts": "Mean / max act.: mean and largest activation over the "
                "described tokens. Top tokens: the most frequent centre tokens of the top contexts. Promoted tokens: "
                "see a concept page. Best class, probe loss, base rate, gain (nats): the class whose probe gains most "
                "over its base-rate entropy. dup: a near-duplicate (cosine > 0.99) of the concept named.",
    "quality": "Probe: test log-loss of the best single concept per class (lower is better), next to the best of "
               "as many random directions (control rows, best of n for n = the set's concept count: choosing the "
               "best of more candidates flatters a set) and the base-rate entropy. Effective rank: exp of the "
               "entropy of the normalised singular values of the unit directions (at most min(n, d)). "
               "Near-duplicates: concepts with another at cosine > 0.99. Top token: the token that is the first top "
               "token of the most concepts. FVU: fraction of variance unexplained by the reconstruction "
               "(1 = predicting the mean; SAEs, fit's last steps). L0: active latents per token.",
    "suite": "Each figure of `conceptlens eval` (parts named 'demo: ...': the demo's own, as it printed them) on "
             "held-out text with its 95% interval, next to its baselines; the "
             "matched control comes first (random directions as many as the set has concepts, centred as the "
             "set's directions are, or zero- and mean-ablation) and 'vs control' says wins or loses only when "
             "the two intervals do not overlap. "
             "k-sparse probe accuracy: logistic regression on the k latents with the largest class mean "
             "difference, balanced one-vs-rest tasks (chance 0.5); diff-of-means: the one supervised direction; "
             "full probe: all raw activations (the ceiling). Lines ending ', codes' read each set by its code (an "
             "SAE's latents; a dense set's assigned concept, one-hot) against random directions read through the "
             "same nonlinearity; the others by activation. Steering lines: intervals over the prompts, each "
             "row's alpha chosen on them; 'minus diff-of-means' / 'minus random' are paired differences over the "
             "same prompts (control: no difference). FVU, CE loss recovered and KL with the reconstruction "
             "spliced in. EVALUATION.md defines every figure and names its source.",
    "suite_concept": "This concept's own figures from `conceptlens eval` (or the demo), with 95% intervals: for each "
                     "probing task where it is among the latents with the largest class mean difference, the test "
                     "accuracy of a logistic probe on it alone (balanced, chance 0.5), next to the same probe on the "
                     "best of as many random directions as the set has concepts (the matched control) and on the "
                     "diff-of-means direction; when it was the concept steered toward a label, the judge's mean "
                     "P(label) at its best alpha within the fluency budget, next to a random direction, the "
                     "diff-of-means vector and a prompt prefix (interval over the prompts), and its paired "
                     "differences to the diff-of-means and random rows over the same prompts.",
    "peers": "Final figures of each trainer on the same cached activations, same width and k, each with its own "
             "recommended hyper-parameters (benchmarks/peers.py): tokens seen, time in optimiser steps, held-out "
             "FVU and L0, and CE loss recovered with the reconstruction spliced in. Not the run above: its own "
             "rows and budget.",
    "extractors": "One row per concept set; never active: its concepts active on none of the described tokens "
                  "(an SAE's latents that did not fire on this text: their pages show no contexts); fit tokens are "
                  "those its fit fed it (fewer than the run's when it had a budget of its own); the activation "
                  "column says how its activations are measured.",
    "norms": "Token norms of the described rows at each site: the row filter drops rows far above the running "
             "median norm (counted here, with the bar); the share of the variance (sum of |x - mean|^2) carried by the 1% "
             "largest-norm tokens would be 1% if every token carried the same; the largest-norm tokens are listed "
             "with their count among the 64 largest.",
    "stats": "Statistics over the described tokens; see the legends of the index.",
}


def figure(content: str, legend: str, cls: str = "") -> str:
    """`content` (already HTML) with its legend (plain text, escaped here) as one figure."""
    from conceptlens.report.html import esc

    attr = f' class="{cls}"' if cls else ""
    return f'<figure{attr}>{content}<figcaption class="legend">{esc(legend)}</figcaption></figure>'
