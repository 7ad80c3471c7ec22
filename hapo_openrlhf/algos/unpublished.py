"""Methods named in the documents this project is built from that cannot be implemented
faithfully: what each lacks, shown by ``hapo list`` and given as the error when a config
names one (``Registry.refuse``). Nothing here is guessed.

Sources (SPEC 2.8): the abstracts of EP-GRPO, PAPO, ERPO and CES state no formulation
that can be computed (no equations, no values). (PRIME, refused here until its implicit
process reward model had a back end to train it, is ``algos/prime.py``.)
"""

from __future__ import annotations

from .advantages import ESTIMATORS
from .losses import LOSSES

REFUSED = {
    "ep_grpo": "EP-GRPO (arXiv 2605.04960): its abstract publishes no formulation (no equations or values), "
               "so any implementation would be a guess",
    "papo": "PAPO (arXiv 2605.11775): its abstract publishes no formulation (no equations or values), so any "
            "implementation would be a guess",
    "erpo": "ERPO (arXiv 2603.28204): its abstract publishes no formulation (no equations or values), so any "
            "implementation would be a guess",
    "ces": "CES (arXiv 2605.19358): its abstract publishes no formulation (no equations or values), so any "
           "implementation would be a guess",
}

for _name, _why in REFUSED.items():  # in either slot a config could name it
    ESTIMATORS.refuse(_name, _why)
    LOSSES.refuse(_name, _why)
