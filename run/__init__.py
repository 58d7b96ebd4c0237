"""The run harness: one rank's life and step loop (``loop``), building a rank, the run's and the tools'
(``setup``), launching ranks (``launch``, ``main``), configs and their Hydra composition (``config``,
``compose``), checks before any rank starts (``preflight``), the memory plan inside a run (``memory_plan``), the
SFT warm-up (``warmup``), every early stop and its save (``save_and_stop``), the progress bar and summary.json
(``record``)."""
