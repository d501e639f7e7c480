"""The planning side, one sub-package per stage: capture, cost, serving, solve; rewrite.py decides what
one rank runs (docs/layout.md)."""
