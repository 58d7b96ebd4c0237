"""The run harness: one rank's step loop (``loop``), building a rank (``setup``), launching ranks (``launch``,
``main``), configs and their Hydra composition (``config``, ``compose``), checks before any rank starts
(``preflight``), the memory plan inside a run (``memory_plan``), the SFT warm-up, saving and stopping
(``save_and_stop``)."""
