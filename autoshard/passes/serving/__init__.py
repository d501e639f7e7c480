"""Serving: time to first token, time per output token and memory of a serving layout, the planner that
meets latency targets, continuous batching."""
