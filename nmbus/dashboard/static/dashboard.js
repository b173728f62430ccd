// Refresh a page's live part without reloading the page: every data-refresh
// milliseconds, fetch its data-fragment (server-rendered, escaped HTML) and swap
// it in. Paused while the tab is hidden; a failed fetch is shown, then retried.
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
          if (stamp) { stamp.textContent = "updated " + new Date().toLocaleTimeString(); stamp.className = "updated"; }
        })
        .catch(function (e) {
          if (stamp) { stamp.textContent = "refresh failed (" + e.message + "), retrying"; stamp.className = "updated bad"; }
        });
    }
    setInterval(tick, every);
  }
  document.addEventListener("DOMContentLoaded", function () {
    var boxes = document.querySelectorAll("[data-fragment]");
    for (var i = 0; i < boxes.length; i++) { start(boxes[i]); }
  });
})();
