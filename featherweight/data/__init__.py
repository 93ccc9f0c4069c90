"""Training data: records from files, tokenized, packed into rows, served as resumable batches."""
