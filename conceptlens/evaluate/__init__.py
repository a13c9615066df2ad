"""The evaluation suite: are a set's concepts good, next to controls, with intervals?

    from conceptlens.evaluate import SuiteConfig, run_suite, format_lines
    lines = run_suite(lens, tok, {"topk": ConceptSet.load("runs/demo/concepts/topk")}, SuiteConfig())
    print(format_lines(lines))          # markdown: value [95% CI] | baselines [95% CI] | verdict

Parts (EVALUATION.md defines each figure and names its source):
- `reconstruction`: FVU, CE-loss recovered and KL to the clean next-token distribution with the
  reconstruction spliced in (next to zero- and mean-ablation), L0, dead and dense fractions;
- `probing`: SAEBench's k-sparse probing next to matched random directions, the diff-of-means
  direction and a full logistic probe;
- `absorption`: SAEBench's first-letter feature absorption;
- `quality`: the single-concept probe, geometry and LDA table;
- `synthetic`: MCC and F1 against SAELens's synthetic ground truth, next to SAELens's own
  trainer (`synthetic.synthetic_lines`; no model; intervals over seeds).
Intervals are a bootstrap over held-out documents (`bootstrap`), over seeds for `synthetic`.
"""

from conceptlens.evaluate.activations import ConceptEncoder, concept_encoder, load_concepts
from conceptlens.evaluate.bootstrap import Estimate, bootstrap
from conceptlens.evaluate.lines import Line, format_lines, verdict
from conceptlens.evaluate.suite import SUITES, SuiteConfig, run_suite

__all__ = ["SUITES", "ConceptEncoder", "Estimate", "Line", "SuiteConfig", "bootstrap", "concept_encoder",
           "format_lines", "load_concepts", "run_suite", "verdict"]
