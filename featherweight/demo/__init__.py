"""The demo: QLoRA on the embedded model and a generated task, accuracy before and after."""
