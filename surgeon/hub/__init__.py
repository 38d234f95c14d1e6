"""The Hugging Face Hub at the two ends of the pipeline.

Input: a Hub model read where it is (:mod:`surgeon.hub.read`: a Hub id -> a ``Source`` whose safetensors are
read through a byte source, :mod:`surgeon.hub.remote`: Range reads, a shard fetched when a writer first needs
it). Output: a folder committed to a repo (:mod:`surgeon.hub.push`), by changes with server-side copies
(:mod:`surgeon.hub.copies`), checked before and after the commit. Every request goes through one HTTP policy
(:mod:`surgeon.hub.http`); every client failure is one line (:mod:`surgeon.hub.failures`).
"""
