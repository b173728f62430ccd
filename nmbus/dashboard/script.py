"""The dashboard's one script, sent inline in every page, and its hash for the CSP.

Every ``data-refresh`` milliseconds it fetches the page's ``data-fragment``
(server-rendered, escaped HTML) and swaps it in, so a page's live part stays
current without a reload; paused while the tab is hidden; a failed fetch is
shown, then retried. It is inline, not a file, so the package ships no script
file, and the Content-Security-Policy allows exactly this text (its SHA-256),
nothing else: no other inline script, no script from anywhere.
"""

from __future__ import annotations

import base64
import hashlib

from markupsafe import Markup

REFRESH_SCRIPT = Markup(
    """
(function () {
  "use strict";
  function start(box) {
    var url = box.getAttribute("data-fragment");
    var every = parseInt(box.getAttribute("data-refresh"), 10) || 5000;
    var stamp = document.getElementById("updated");
    function tick() {
      if (document.hidden) { return; }
      fetch(url, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) {
          if (!r.ok) { throw new Error("HTTP " + r.status); }
          return r.text();
        })
        .then(function (html) {
          box.innerHTML = html;
          if (stamp) {
            stamp.textContent = "updated " + new Date().toLocaleTimeString();
            stamp.className = "updated";
          }
        })
        .catch(function (e) {
          if (stamp) {
            stamp.textContent = "refresh failed (" + e.message + "), retrying";
            stamp.className = "updated bad";
          }
        });
    }
    setInterval(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    var boxes = document.querySelectorAll("[data-fragment]");
    for (var i = 0; i < boxes.length; i++) { start(boxes[i]); }
  });
})();
"""
)

#: The CSP source that allows REFRESH_SCRIPT: the hash of the text between the tags.
REFRESH_SCRIPT_SOURCE = (
    "'sha256-" + base64.b64encode(hashlib.sha256(REFRESH_SCRIPT.encode()).digest()).decode() + "'"
)
