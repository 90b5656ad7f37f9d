"""Demo depth models: a task where depth pays (task.py) and its tokenizer (tokenizer.py)."""
