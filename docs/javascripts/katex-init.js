// Render the site's math with the vendored KaTeX (no network needed).
//
// Markdown pages: pymdownx.arithmatex (generic mode) wraps math in .arithmatex elements as
// \( ... \) and \[ ... \]. Notebook pages: mkdocs-jupyter leaves the notebooks' $ ... $ and
// $$ ... $$ as they are inside .jupyter-wrapper. Code (pre, code) is never touched.
(function () {
  "use strict";

  var DISPLAY = [
    { left: "$$", right: "$$", display: true },
    { left: "\\[", right: "\\]", display: true },
  ];
  var INLINE = [
    { left: "\\(", right: "\\)", display: false },
    { left: "$", right: "$", display: false },
  ];

  function render(element, delimiters) {
    window.renderMathInElement(element, {
      delimiters: delimiters,
      throwOnError: false,
      ignoredClasses: ["no-math", "clipboard-copy-txt"],  // the copy buttons' hidden source copies
    });
  }

  function renderPage(root) {
    root.querySelectorAll(".arithmatex").forEach(function (element) {
      render(element, [DISPLAY[1], INLINE[0]]);
    });
    root.querySelectorAll(".jupyter-wrapper").forEach(function (element) {
      render(element, DISPLAY.concat(INLINE));
    });
  }

  if (typeof window.document$ !== "undefined") {
    // mkdocs-material: runs on the first load and after each instant navigation.
    window.document$.subscribe(function () {
      renderPage(document);
    });
  } else {
    document.addEventListener("DOMContentLoaded", function () {
      renderPage(document);
    });
  }
})();
