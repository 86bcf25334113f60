package shed_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// TestExportedAPIAvoidsInternalPackages fails if an exported identifier of
// pkg/shed (a type, a field of an exported struct, a method of an exported
// interface, a function or method signature, a variable or constant) names a
// type from a package whose path contains "/internal/": a service in another
// module could not use it ("use of internal package ... not allowed"). Test
// files in this module can import internal packages, so an external test
// alone would not catch it.
func TestExportedAPIAvoidsInternalPackages(t *testing.T) {
	names, err := filepath.Glob("*.go")
	if err != nil || len(names) == 0 {
		t.Fatalf("no Go files found in pkg/shed: %v", err)
	}
	fset := token.NewFileSet()
	var leaks []string
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatalf("parse %s: %v", name, err)
		}
		internal := internalImports(f)
		check := func(where string, n ast.Node) {
			ast.Inspect(n, func(n ast.Node) bool {
				if sel, ok := n.(*ast.SelectorExpr); ok {
					if id, ok := sel.X.(*ast.Ident); ok && internal[id.Name] != "" {
						leaks = append(leaks, where+" uses "+internal[id.Name]+"."+sel.Sel.Name)
					}
				}
				return true
			})
		}
		for _, decl := range f.Decls {
			checkDecl(decl, check)
		}
	}
	sort.Strings(leaks)
	for _, l := range leaks {
		t.Errorf("exported API leaks an internal package: %s", l)
	}
}

// internalImports maps the local name of each internal package f imports to
// its path.
func internalImports(f *ast.File) map[string]string {
	internal := map[string]string{}
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		if !strings.Contains(path, "/internal/") && !strings.HasPrefix(path, "internal/") {
			continue
		}
		name := path[strings.LastIndex(path, "/")+1:]
		if imp.Name != nil {
			name = imp.Name.Name
		}
		internal[name] = path
	}
	return internal
}

// checkDecl passes check the type expressions of decl that other modules
// see: exported types (only the exported fields and methods of structs and
// interfaces), exported variables and constants, and the signatures of
// exported functions and of exported methods on exported types.
func checkDecl(decl ast.Decl, check func(string, ast.Node)) {
	switch d := decl.(type) {
	case *ast.FuncDecl:
		if !d.Name.IsExported() {
			return
		}
		name := d.Name.Name
		if d.Recv != nil {
			recv := receiverName(d.Recv.List[0].Type)
			if !ast.IsExported(recv) {
				return
			}
			name = recv + "." + name
		}
		check(name, d.Type)
	case *ast.GenDecl:
		for _, spec := range d.Specs {
			switch s := spec.(type) {
			case *ast.TypeSpec:
				if s.Name.IsExported() {
					checkType(s.Name.Name, s.Type, check)
				}
			case *ast.ValueSpec:
				for _, n := range s.Names {
					if n.IsExported() && s.Type != nil {
						check(n.Name, s.Type)
					}
				}
			}
		}
	}
}

// checkType checks a named type's definition, skipping unexported fields and
// interface methods.
func checkType(name string, typ ast.Expr, check func(string, ast.Node)) {
	var fields *ast.FieldList
	switch t := typ.(type) {
	case *ast.StructType:
		fields = t.Fields
	case *ast.InterfaceType:
		fields = t.Methods
	default:
		check(name, typ)
		return
	}
	for _, f := range fields.List {
		if len(f.Names) == 0 { // embedded: exported if its type name is
			if ast.IsExported(receiverName(f.Type)) {
				check(name+"."+receiverName(f.Type), f.Type)
			}
			continue
		}
		for _, n := range f.Names {
			if n.IsExported() {
				check(name+"."+n.Name, f.Type)
			}
		}
	}
}

// receiverName returns the type name of a receiver or embedded field: T, *T,
// pkg.T or T[P].
func receiverName(e ast.Expr) string {
	switch t := e.(type) {
	case *ast.StarExpr:
		return receiverName(t.X)
	case *ast.SelectorExpr:
		return t.Sel.Name
	case *ast.IndexExpr:
		return receiverName(t.X)
	case *ast.IndexListExpr:
		return receiverName(t.X)
	case *ast.Ident:
		return t.Name
	}
	return ""
}
