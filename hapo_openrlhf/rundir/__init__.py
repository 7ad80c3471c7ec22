"""A run's folder, as every back end shares it: atomic checkpoints and their listing
(``checkpoint``), the one-owner lock (``runlock``), the stop flag and preemption exit
(``preemption``), bounded reads of the small JSON files (``jsonfile``), removal of only
what the run owns (``fsguard``), and ``metrics.jsonl`` with its bounded reader (``logger``).
Imports nothing else of the package."""
