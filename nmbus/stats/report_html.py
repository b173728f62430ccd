import json


def render(summary):
    return "<html><body><pre>" + json.dumps(summary) + "</pre></body></html>"
