"""Engine core: sequences, block manager, scheduler (torch-free) and the engine step."""
