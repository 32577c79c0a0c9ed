"""The model's building blocks, apart from the model: linears, attention (metadata and backend), rotary, RMSNorm.

``engine/model.py`` assembles them into the decoder layers (as ``engine/families.py``
describes each family) and loads the weights; ``engine/quant.py`` provides the quantized
linears the model builder picks instead of the dense ones.
"""
