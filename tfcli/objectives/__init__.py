"""Pretraining objectives: plug-ins (tfcli.plugin) registered in tfcli.registry.OBJECTIVES, one module
each; objective.py holds their base classes, losses.py the losses they (and text-to-text tasks) train."""
