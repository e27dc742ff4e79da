"""What a run is: its arguments, facts, process group, preemption signal and checkpoint storage; read by callbacks and checkpoints."""
