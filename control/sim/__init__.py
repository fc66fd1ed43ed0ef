"""`wakegate sim`: an OpenAI-compatible backend simulator that behaves like vLLM.

main.py is the process; app.py the handlers; metrics.py its vLLM-named metrics.
"""
