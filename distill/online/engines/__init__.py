"""The engines the online stage can be served by (`engine=llamacpp | vllm`), one module each;
they share only `base` (the protocol and the answer a journal keeps) and never import each other."""
