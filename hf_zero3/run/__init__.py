"""One training run: its arguments and facts, the train entry, data, the process group, and the launcher."""
