"""The flows around the engine: reading shards, tokenizing, packing, writing vector tables.

Pipelines know files and rows; they never touch CUDA. The engine never imports anything from here.
"""
