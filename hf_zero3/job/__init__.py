"""What a run is: its arguments, facts, process group, preemption signal and checkpoint storage; asked by the
callbacks, the checkpoints and the run itself."""
