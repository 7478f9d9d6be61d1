"""Attention kernels: the reference (torch), and fused decode kernels over the cache."""
