"""What every driver shares: the effect runtime, run parameters, placement, request bookkeeping,
fault specs, wedge diagnosis and the run outcome. Nothing here knows SimPy, sockets or torch."""
