"""Where an image can run: inventory models, NVIDIA requirement evaluation, the decision.

Pure: no HTTP and no SQL. Imports scanner/ models only.
"""
