"""Fused kernels (installed as ``shardlib.kernels``), each with a reference implementation it is tested against.

Empty until the kernels issue lands (fused attention through transformers' attention interface, fused QKV,
fused epilogues); the package exists so the install layout is final.
"""
