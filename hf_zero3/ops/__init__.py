"""Operations beside the flow: the preflight doctor, its all-reduce probe, and the side-by-side benchmark."""
