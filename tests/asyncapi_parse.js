// Parse AsyncAPI documents with the AsyncAPI project's own parser (@asyncapi/parser,
// found through NODE_PATH) and print, for each file given, one JSON line:
// {"file": ..., "parsed": true|false, "diagnostics": [{code, severity, message, path}]}.
// Severity: 0 error, 1 warning, 2 information, 3 hint.
const fs = require("fs");
const { Parser } = require("@asyncapi/parser");

(async () => {
  const parser = new Parser();
  for (const file of process.argv.slice(2)) {
    const { document, diagnostics } = await parser.parse(fs.readFileSync(file, "utf8"));
    const found = diagnostics.map((d) => ({
      code: d.code,
      severity: d.severity,
      message: d.message,
      path: d.path,
    }));
    console.log(JSON.stringify({ file, parsed: document !== undefined, diagnostics: found }));
  }
})().catch((err) => {
  console.error(err);
  process.exit(1);
});
