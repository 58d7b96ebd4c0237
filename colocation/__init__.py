"""How the actor and the engine share one device, as data (a leaf package: imports nothing from this project):
the step's phase table (``phases``), each engine's memory behaviour (``engines``), and giving freed host
memory back to the OS (``host_memory``)."""
