"""Scoring translations: sacreBLEU and chrF with their signatures."""
