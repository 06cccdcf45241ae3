"""Deployment configurations: the same Definitions with another executor or instance storage.

Nothing here changes what the assets compute; each module only picks how and where steps run.
"""
