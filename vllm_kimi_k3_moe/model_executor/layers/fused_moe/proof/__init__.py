"""The proof the partition patch owes where ``verification`` let the fixes
go on code they were not verified on (or through a target other code
replaced at run time): ``first_layer`` holds what is owed and settles it at
the first Kimi-K3 routed-experts layer vLLM builds, ``small_layer`` builds
and checks small copies of that layer with the patches on,
``unwritten_memory`` makes every fresh allocation read as random bytes.

It runs the patches, so it lives beside them; ``verification`` (which reads
vLLM's code and decides) imports nothing of ``model_executor``.
"""
