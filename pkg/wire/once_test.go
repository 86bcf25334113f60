package wire

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestWireNamesAreDeclaredOnlyHere fails when production code of the module
// spells a header or a metadata key as a string literal instead of importing
// it from this package, or declares a string type for states of its own
// (a type whose name ends in State), or a clock interface beside pkg/clock's
// (an interface of just Now): the two sides of a wire would then be
// free to drift apart. Tests may spell the values, to pin them. api/v1alpha1
// is the exception for states: the CRD keeps its own string type and enum,
// whose strings the controller converts in one place and its tests pin.
func TestWireNamesAreDeclaredOnlyHere(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root not found at %s: %v", root, err)
	}
	names := map[string]string{} // lower-case value -> constant
	for name, v := range map[string]string{
		"AttemptHeader": AttemptHeader, "DeadlineHeader": DeadlineHeader, "DefaultCallerHeader": DefaultCallerHeader,
		"RetryAfterHeader": RetryAfterHeader, "PreviousAttemptsMetadata": PreviousAttemptsMetadata,
		"RetryAfterMetadata": RetryAfterMetadata, "PushbackMetadata": PushbackMetadata,
	} {
		names[strings.ToLower(v)] = name
	}
	here := filepath.Join(root, "pkg", "wire")

	fset := token.NewFileSet()
	var found []string
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); path != root && (strings.HasPrefix(n, ".") || n == "testdata" || n == "vendor") || path == here {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		api := strings.HasPrefix(filepath.ToSlash(rel), "api/")
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.BasicLit:
				if n.Kind != token.STRING {
					return true
				}
				v, err := strconv.Unquote(n.Value)
				if err != nil {
					return true
				}
				if c, ok := names[strings.ToLower(v)]; ok {
					found = append(found, fset.Position(n.Pos()).String()+": "+strconv.Quote(v)+" is wire."+c)
				}
			case *ast.TypeSpec:
				if id, ok := n.Type.(*ast.Ident); ok && id.Name == "string" && strings.HasSuffix(n.Name.Name, "State") && n.Assign == 0 && !api {
					found = append(found, fset.Position(n.Pos()).String()+": a string type "+n.Name.Name+" beside wire.State")
				}
				if it, ok := n.Type.(*ast.InterfaceType); ok && len(it.Methods.List) == 1 && len(it.Methods.List[0].Names) == 1 &&
					it.Methods.List[0].Names[0].Name == "Now" && filepath.ToSlash(filepath.Dir(rel)) != "pkg/clock" {
					found = append(found, fset.Position(n.Pos()).String()+": a clock interface "+n.Name.Name+" beside clock.Clock")
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range found {
		t.Errorf("declared twice (use pkg/wire and pkg/clock): %s", f)
	}
}
