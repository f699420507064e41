"""What the server keeps on disk beside the KV cache: the stored responses of ``/v1/responses``
(``responses.py``), in files written atomically and read without following links
(``files.py``)."""
