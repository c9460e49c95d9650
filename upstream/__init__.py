"""The in-tree form of the fix: a patch against each supported vLLM release's
own source files (``vllm-0.33.0.patch``, ``vllm-0.34.0.patch``; which is for
which: ``upstream.patches``) and the command that verifies the installed
release's (``python -m upstream.verify_patch``) on a patched copy of the
installed vLLM, with this plugin disabled. Nothing here runs inside vLLM.
"""
