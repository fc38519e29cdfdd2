"""Data access: keyword-only functions taking the session first, knowing nothing of HTTP.

Each state change writes its audit event in the same transaction and commits.
"""
