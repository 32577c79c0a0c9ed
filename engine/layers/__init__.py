"""The model's building blocks, apart from the model: linears, attention (metadata and backend), rotary.

``engine/model.py`` assembles them into the decoder layers and loads the weights;
``engine/quant.py`` provides the quantized linears the model builder picks instead of
the dense ones.
"""
