"""Finetuning tasks: plug-ins (tfcli.plugin) registered in tfcli.registry.TASKS, one module each;
classification.py holds what the classification tasks share."""
