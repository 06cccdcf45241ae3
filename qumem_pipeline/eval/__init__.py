"""Evaluation, apart from the product: it depends on the product, never the other way.

`segmentation` scores episode boundaries (TIAGE and segments formats); `locomo` scores retrieval
units and strategies on LoCoMo.
"""
