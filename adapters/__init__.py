"""Thin adapters that put Zero-1 into existing trainers (Tunix, MaxText-style engines)."""
