"""Launch: the run config as OpenRLHF's command line (``flags``, the one place that knows its
flags), OpenRLHF's own parser and main with hapo's classes installed (``train``,
``upstream_cli``), the prompt files (``data``) and the reward file OpenRLHF loads (``reward_func``).
Only ``flags`` may be imported without OpenRLHF installed."""
