"""Command-line checks and benchmarks (``make parity``, ``verify-sync``, ``bench-*``, ``plan``): they import
the packages as any user would and live outside them."""
