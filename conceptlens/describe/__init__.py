"""The description pass: what each fitted concept is (top contexts, histograms, neighbours, tokens).

    from conceptlens.describe import Description, describe
    descriptions = lens.describe({"topk": cs}, held_out_texts, out="runs/x/describe")
"""

from conceptlens.describe.describer import ConceptDescriber, DescribeConfig
from conceptlens.describe.description import Description
from conceptlens.describe.run import FinishOptions, SteeringRequest, describe, finish
from conceptlens.describe.topn import TopN

__all__ = ["ConceptDescriber", "DescribeConfig", "Description", "FinishOptions", "SteeringRequest", "TopN",
           "describe", "finish"]
