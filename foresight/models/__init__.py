"""The drafter's models: the JetSpec draft model, the foresight adapter and the foresight decoder.

Plain torch modules with their checkpoint formats; the drafter worker serves them and training builds
them, and neither side needs the other to import them.
"""
