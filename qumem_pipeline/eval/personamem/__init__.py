"""PersonaMem evaluation: the seeds' own benchmark (pick the response that fits this user now).

``data`` loads either layout as the harness's conversations, ``prompts`` holds the two answer
methods, ``likelihood`` scores options through the record, ``run`` is ``qumem eval personamem``.
"""
