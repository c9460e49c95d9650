"""The in-tree form of the fix: a patch against vLLM 0.33.0's own source files
(``vllm-0.33.0.patch``) and the command that verifies it
(``python -m upstream.verify_patch``) on a patched copy of the installed
vLLM, with this plugin disabled. Nothing here runs inside vLLM.
"""
