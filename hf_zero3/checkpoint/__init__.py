"""After a save: what a complete checkpoint is (lifecycle), export to a plain HF folder, and the Hub."""
