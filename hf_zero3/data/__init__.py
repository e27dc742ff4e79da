"""Training data: where it comes from (files, the Hub, mixtures), what shape it has (raw text, chat, prompt and
completion), how it becomes token ids with a loss mask, and how examples are packed into blocks without attending
to each other. Below `run/`: nothing here knows about DeepSpeed or the Trainer's set-up."""
